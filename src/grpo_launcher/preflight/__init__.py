"""Pre-flight: every rule that judges a RunSpec before anything starts, and the memory and disk models they use.

preflight/validate.py runs the rules (RULE_MODULES: pre-flight's own theme modules here, then each room's
ROOM/rules.py); preflight/registry.py is how a rule registers (`@rule`). Nothing is imported here: a room's rules
import the registry, and the registry must not pull the rules in.
"""
