"""Workers: the RQ worker process (engine call -> claim -> verify -> spool) and its engine clients."""
