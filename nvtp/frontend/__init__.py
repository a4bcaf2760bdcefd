"""Thunder front end: nvtp's Thunder executor and the translation of Thunder prims to nvtp ops."""
