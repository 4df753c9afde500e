"""Running a model across several Macs: the Engine settings section that lists the Macs.

What lives here: view.py (`ClusterView`: the Macs found on the local network by mDNS or typed
by address, each one's memory and MLX version, which to run across, the preflight line;
`ClusterDialog` holds it for the Engine menu). Network waits run on a Python thread of their
own and come back as queued signals; nothing here touches MLX's arrays.
"""
