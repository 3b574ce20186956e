"""Why the admission queue did not grant a request: one exception per reason, each carrying its HTTP status from here,
where it is raised (429 with Retry-After where a retry may pass, 400 where it never can, 503 with no replica), and its
outcome as the admission metrics name it (dcpserve/deployments/metrics.py ADMISSION_OUTCOMES). KvAdmission answers the
ingress with `refusal()`, the error as a message (dcpserve/deployments/messages.py `Refusal`)."""

from __future__ import annotations

import math

from dcpserve.deployments.admission.tenant_limits import Exceeded
from dcpserve.deployments.messages import Refusal


class AdmissionError(Exception):
    """A request the queue did not grant: `code` (the OpenAI error code), `status` (HTTP), `outcome` (the metric)."""

    code = "error"
    outcome = "rejected"
    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def refusal(self, retry_after_s: int) -> Refusal:
        """This error as the queue's answer; a 429 or 503 says Retry-After: retry_after_s (the app's)."""
        return Refusal(self.code, self.message, self.status, retry_after_s if self.status in (429, 503) else None)


class QueueFull(AdmissionError):
    code, outcome, status = "queue_full", "rejected_queue_full", 429


class QueueTimeout(AdmissionError):
    code, outcome, status = "queue_timeout", "rejected_timeout", 429


class DeadlineExceeded(AdmissionError):
    code, outcome, status = "deadline_exceeded", "rejected_deadline", 429  # its deadline came while it waited


class Shed(AdmissionError):
    code, outcome, status = "shed", "rejected_shed", 429  # sheddable, refused under saturation


class LimitExceeded(AdmissionError):
    """A tenant's limit (dcpserve/deployments/admission/tenant_limits.py): 429 with the Retry-After the limit gives,
    or 400 when the request alone is past it (retry_after_s None: no retry can pass)."""

    code, outcome, status = "limit_exceeded", "rejected_limit", 429

    def __init__(self, exceeded: Exceeded) -> None:
        super().__init__(exceeded.message)
        self.limit = exceeded.limit
        self.retry_after_s = exceeded.retry_after_s
        if exceeded.retry_after_s is None:
            self.status = 400

    def refusal(self, retry_after_s: int) -> Refusal:
        if self.retry_after_s is None:
            return Refusal(self.code, self.message, 400)
        return Refusal(self.code, self.message, 429, max(math.ceil(self.retry_after_s), 1))


class NeverFits(AdmissionError):
    code, outcome, status = "never_fits", "rejected_never_fits", 400


class NoReplica(AdmissionError):
    code, outcome, status = "no_replica", "rejected_no_replica", 503
