"""What a process is: the command line and every role it runs. cli.py parses
the flags and dispatches to ``run(args)`` of the module named after the command
(join, serve, bootstrap, relay, api, monitor, status, certify, demo, shard,
identity, audit, review); flags.py is what they share; volunteer.py is the
volunteer ``join`` runs, its duties each a class; their metrics and terminal
progress. Nothing imports roles.

May import: every other package.
"""
