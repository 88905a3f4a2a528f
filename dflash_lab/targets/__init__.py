"""Target adapter: load a frozen HF target (:mod:`.loader`, :mod:`.target`), render conversations
(:mod:`.chat`), extract features (:mod:`.features`); the built-in tiny target in :mod:`.tiny`."""
