"""Reusable Lightning plugins: intra-node sharding with PowerSGD between nodes, and per-resblock 16-bit scaling.

Never imports ``dalle_lightning``: models talk to these plugins through the ``resblocks()`` protocol
(see ``strategies/protocol.py``) or through module classes / name patterns given in config.
"""
