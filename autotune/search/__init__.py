"""The search: the space, the objective, Optuna's study, its storage and the gate."""
