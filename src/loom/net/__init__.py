"""Authenticated transports: the job secret and its proofs (`loom.net.auth`), and the job's store
(`loom.net.store`). Every socket loom opens proves the job secret here before a byte is decoded."""
