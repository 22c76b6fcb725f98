"""Making batch files: production decides which seq and when, a backend makes it."""
