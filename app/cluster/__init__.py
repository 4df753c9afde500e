"""Running a model across several Macs: the Engine settings section that lists the Macs.

What lives here: view.py (`ClusterView`: the Macs found on the local network by mDNS or typed
by address, each one's memory and MLX version, which to run across, the preflight line;
`ClusterDialog` holds it for the Engine menu), memory_rows.py (`MacsBox`: the memory panel's
row a Mac for a split model), screenshot.py (`python -m app.cluster.screenshot OUT.png`).
Network waits run on a Python thread of their own and come back as queued signals; nothing
here touches MLX's arrays.
"""
