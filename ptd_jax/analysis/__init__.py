"""Looking inside traced and compiled programs: the collectives of a jaxpr or HLO (`collectives.py`)."""
