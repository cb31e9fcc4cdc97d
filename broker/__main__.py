# ``python -m broker`` is the ``gdrl-broker`` program, whose peer subcommands live in clients/: this entry
# point is the one file of broker/ that may import clients (tests/test_layers.py names it).
from clients.cli import main

main()
