"""Pure partition algorithms over plain data (see problem.py for the cost they minimise)."""
