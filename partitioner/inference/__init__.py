"""Pricing a plan for generation: weights, key/value caches, working memory and decode steps per stage."""
