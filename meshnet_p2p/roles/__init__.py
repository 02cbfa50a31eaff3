"""What a process is: the command line and every role it runs. cli.py parses
the flags and dispatches to ``run(args)`` of the module named after the command
(join, serve, bootstrap, relay, api, monitor, status, certify, demo, shard,
identity); flags.py is what they share; their metrics and terminal progress.
Nothing imports roles.

May import: every other package.
"""
