"""Voices cloned from a reference clip: the clip's checks (:mod:`.clip`) and the store
that keeps them (:mod:`.store`)."""
