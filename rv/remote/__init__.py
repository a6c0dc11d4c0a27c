"""How a command reaches the cluster: the route, the transports (local, SSH, warm) and the one loop
that drives their commands, the warm connection's background process, the SSH configuration, the
agent's client, tunnels and the interactive terminal.

    connect.py       the route: every choice on the way to the cluster is made here, and only here
    transport.py     the transport API: run, stream, put and get, on the cluster or locally
    ssh.py           one SSH connection in this process: the one module that connects with paramiko
    sshconfig.py     where to connect: the profile laid over what OpenSSH makes of ~/.ssh/config
    warm.py          warm connections, the client side: one background process per profile
    warmd.py         the warm connection's background process, holding the SSH connection
    warmwire.py      what travels between a command and its warm connection: frames, errors
    agent_client.py  talking to rv's agent (rv.agent): one `python3 -c` call per operation, retried
                     once on a fresh connection where repeating it is safe (ON_LOST)
    tunnel.py        a local port that reaches a port on the cluster (`rv forward`)
    terminal.py      this terminal joined to a remote one (`rv up`, `rv ssh`)
    nodessh.py       plain OpenSSH to a node of a running job (`rv code`)
"""
