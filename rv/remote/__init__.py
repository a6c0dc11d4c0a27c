"""How a command reaches the cluster: the route (connect), the transports (local, SSH, warm) and the
one loop that drives their commands (transport.run_process), the warm connection's background
process (warmd) and what travels to it (warmwire), the SSH configuration, the agent's client,
tunnels and the interactive terminal."""
