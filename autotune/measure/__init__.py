"""One trial's measurement: start a server, replay the window, read its metrics."""
