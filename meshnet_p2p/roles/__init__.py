"""What a process is: the command line and every role it runs (join, serve,
bootstrap, relay, api, monitor, status, certify, demo), their metrics and
terminal progress. Nothing imports roles.

May import: every other package.
"""
