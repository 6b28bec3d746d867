"""`python -m agentrl` is the `agentrl` command."""

from agentrl.cli import main

main()
