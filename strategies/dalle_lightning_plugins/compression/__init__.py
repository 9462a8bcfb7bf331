"""The gradient exchange between nodes: PowerSGD with Householder orthogonalisation, the overlapped exchange and its wire, the step's agreed flags, local steps' outer step."""
