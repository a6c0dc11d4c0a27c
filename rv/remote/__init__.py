"""How a command reaches the cluster: the route (connect), the transports (local, SSH, warm), the
SSH configuration, the agent's client, tunnels and the interactive terminal."""
