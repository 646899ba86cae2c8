"""What one FusedAttention function body computes: a :class:`BodyPlan` (the generic body's,
:data:`GENERIC`, or a lean variant's: ``attn_export.onnx.node.BodyVariant``), whose steps a node
attribute switches are each :class:`When`. onnx/body.py writes the body a plan describes."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class When(enum.Enum):
    """When a body does a step that a node attribute switches."""

    NEVER = "never"
    ALWAYS = "always"
    BY_ATTRIBUTE = "by attribute"  # selected at run time from the calling node's attribute

    @classmethod
    def of(cls, on: bool) -> "When":
        return cls.ALWAYS if on else cls.NEVER


@dataclass(frozen=True)
class BodyPlan:
    """What one function body computes."""

    causal: When  # the is_causal attribute's mask
    softcap: When  # the softcap attribute's soft-capping
    key_padding_mask: bool  # adds the key_padding_mask input (False: reads only its shape)
    attn_mask: bool  # adds the attn_mask input (False: reads only its shape)
    float32: bool  # T is float32: no casts
    # The causal_alignment attribute's bottom-right alignment (NEVER: top-left); read only when
    # the causal mask is there.
    bottom_right: When = When.NEVER
    grouped: bool = False  # repeats each key/value head for its group (kv_num_heads)
    # The window attribute's sliding window (ALWAYS: the node's window is > 0); read only when the
    # causal mask is there.
    window: When = When.NEVER
    # The cache form: inputs past_key/past_value, outputs present_key/present_value.
    past: bool = False
    # The alibi_slopes attribute's bias (ALWAYS: the node has slopes; BY_ATTRIBUTE: an empty list
    # adds zeros).
    alibi: When = When.NEVER

    @property
    def guards_dead_rows(self) -> bool:
        """Whether rows may lose every key: a mask may empty one, and so may bottom-right causal
        masking when Lq > Lk (top-left, query i always sees key 0), and a window when Lq > Lk (a
        top-left row past the last key)."""
        causal = self.causal is not When.NEVER
        shaped = causal and (self.bottom_right is not When.NEVER or self.window is not When.NEVER)
        return self.key_padding_mask or self.attn_mask or shaped


# Right for every node, whatever its attributes and T: a placeholder mask adds zeros, and a
# group of one key/value head per query head repeats nothing.
GENERIC = BodyPlan(causal=When.BY_ATTRIBUTE, softcap=When.BY_ATTRIBUTE, key_padding_mask=True, attn_mask=True,
                   float32=False, bottom_right=When.BY_ATTRIBUTE, grouped=True, window=When.BY_ATTRIBUTE,
                   alibi=When.BY_ATTRIBUTE)
