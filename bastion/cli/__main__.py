"""`python -m bastion.cli`."""

from bastion.cli.main import main

main()
