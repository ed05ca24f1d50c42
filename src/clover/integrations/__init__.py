"""Bridges from Clover to third-party tools (evaluation harnesses, ...).

Each integration lives in its own subpackage and imports its tool only there, so `import clover`
never needs an optional dependency; installing the matching extra (`pip install clover[lm-eval]`)
is what makes a subpackage importable.
"""
