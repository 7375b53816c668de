"""Training maths: the inner phase, the outer optimizer and the papers' outer rules, codecs, mixing weights, partner
draws, pacing. Imports only the ground floor (errors, tensor_layout): no networking (tests/test_architecture.py).
"""
