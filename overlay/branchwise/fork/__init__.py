"""Server-side fork/join of parallel phases; hooks.py is the top (docs/design/server-fork.md)."""
