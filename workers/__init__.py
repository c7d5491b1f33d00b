"""Workers: the RQ job (engine call -> claim -> verify -> spool), engine clients, the engines' dump side."""
