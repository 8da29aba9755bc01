"""mlxcel."""
