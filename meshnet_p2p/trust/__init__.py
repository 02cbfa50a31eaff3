"""What a client believes about a recipe and a hop: what each hop attests
about what it computed (attestation: what the data plane needs), certification
evidence, its check and its records (evidence), what a proven mismatch
carries and how anyone checks that it stands (fraud_proof), fraud reports and
certifiers' verdicts as records (verdicts), and the client's trust policy
over certifiers (policy).

May import: core, engine.
"""
