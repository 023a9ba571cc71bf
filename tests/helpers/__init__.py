"""Plain helpers shared across the test directories (no tests here; ``tests`` is on the path)."""
