"""Request handling before the scheduler: the HTTP server process and the DP controller."""
