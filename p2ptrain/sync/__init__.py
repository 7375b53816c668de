"""Outer-sync strategies (DiLoCo, GASLoC, Factored) and the gossips they use: where maths and net meet."""
