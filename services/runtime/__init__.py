"""Runtime shared by the four services: server factory, auth, errors, logging."""
