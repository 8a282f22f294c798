"""Config schema, composition and pre-flight rules."""
