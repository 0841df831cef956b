"""Looking inside traced and compiled programs: one walker over jaxprs (`jaxpr.py`: counts, matmul FLOPs, named
calls) and the collectives of a jaxpr or of compiled HLO (`collectives.py`)."""
