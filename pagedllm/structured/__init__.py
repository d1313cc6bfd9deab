"""Structured outputs: constrain decoding to a JSON schema, a regex, a choice or a grammar.

(Library choice and measurements: filled in below.)
"""
