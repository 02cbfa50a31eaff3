"""What a client believes about a recipe and a hop: what each hop attests
about what it computed (attestation: what the data plane needs), certification
evidence, its check and its records (evidence), and the client's trust policy
over certifiers (policy).

May import: core, engine.
"""
