"""Recipes: the demo and the label-efficiency protocol, built on the library.

The command line (`vlm_vit.cli`) runs them; the library never imports them.
"""
