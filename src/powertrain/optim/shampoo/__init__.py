"""Distributed Shampoo (Shi et al., arXiv 2309.06497). So far: the math layer (:mod:`.matrix`, :mod:`.blocks`)."""
