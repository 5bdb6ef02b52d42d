"""Tools to develop and show bastion, outside its trust path: the demo, the sshd fixture."""
