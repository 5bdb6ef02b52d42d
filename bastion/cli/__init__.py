"""The `bastion` command line: the group in `main.py`; keys, audit and the prompt apart."""
