"""Run labels (``method``) name the policy's class: a user's RigL subclass is not reported as RigL."""
import pytest

from sparsetrain.sparsity import SET, GradualMagnitude, PruneRegrow, RigL, Static
from sparsetrain.sparsity.policies import Magnitude, Policy


class GradEMA(RigL):
    def grow_scores(self, weight, grad, mask):
        return grad.abs()


class Renamed(SET):
    name = "my_label"


class FromBase(Policy):
    def grow_scores(self, weight, grad, mask):
        return weight.abs()


@pytest.mark.parametrize("policy, label", [
    ("set", "prune_regrow/random"), (SET(), "prune_regrow/random"),        # built-ins keep today's labels,
    ("rigl", "prune_regrow/gradient"), (RigL, "prune_regrow/gradient"),    # so old runs group with new ones
    (Magnitude(), "prune_regrow/magnitude"),
    (GradEMA(), "prune_regrow/GradEMA"), (GradEMA, "prune_regrow/GradEMA"),  # a subclass: its class name
    (Renamed(), "prune_regrow/my_label"),                                   # unless it names itself
    (FromBase(), "prune_regrow/FromBase"),
])
def test_prune_regrow_label_names_the_policy_class(policy, label):
    sched = PruneRegrow(policy=policy)
    assert sched.method == sched.describe() == label


def test_subclass_of_a_subclass_and_other_schedulers():
    class Deeper(GradEMA):
        pass

    assert PruneRegrow(policy=Deeper()).describe() == "prune_regrow/Deeper"
    assert GradEMA.name == "GradEMA" and RigL.name == "gradient"   # the parent's label is untouched
    assert Static().describe() == "static" and GradualMagnitude().describe() == "gradual_magnitude"
