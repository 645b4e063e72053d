"""What a run claims and hands over: outcome, best.yaml, report.md, publishing."""
