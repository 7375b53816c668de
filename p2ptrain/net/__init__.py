"""The network: libp2p/DHT set-up, discovery records, the wire, the push-pull exchange, all-reduce, state sharing,
and the event-loop thread. Imports only the ground floor: no training maths (tests/test_architecture.py checks it).
"""
