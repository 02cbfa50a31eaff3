"""What a client believes about a recipe and a hop: what each hop attests
about what it computed, certification evidence and its check, and the
client's trust policy over certifiers.

May import: core, engine.
"""
