"""Request handling logic, free of any web framework."""
