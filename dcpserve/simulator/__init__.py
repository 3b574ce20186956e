"""dcpserve simulate: the real control plane (admission queue, replica choice, autoscaling policy, scheduler, block
manager, prefix cache) driven by simulated time, with the model forward replaced by a step-time model."""
