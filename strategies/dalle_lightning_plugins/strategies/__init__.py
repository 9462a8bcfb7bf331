"""The strategies and how they wire FSDP2 within a node: the mesh, the units and their prefetch, Lightning's collectives on sharded values."""
