"""The frameworks people write models with, one module each; imported only when the user's own
objects are of that library's types, so that stagetool runs without them.

Every read of another library's private attribute is marked ``# private-api:`` so that
``grep -rn "private-api:" stagetool`` finds them all.
"""
