//! The RAS wiring of a CQ: its description (`softwarp resources`) and statistics.

use crate::instrument::attrs;
use softwarp_ras::stats::StatsBuilder;
use softwarp_ras::tracker::{DescribeResource, ResourceDetails};

use crate::verbs::cq::{CqShared, CqView};

impl CqView {
    pub(super) fn collect(&self, out: &mut StatsBuilder, dev: &str) {
        let id = self.id.to_string();
        let labels = [("device", dev), ("cq", id.as_str())];
        out.counter(
            "softwarp_cq_completions_total",
            "Completions queued.",
            &labels,
            self.completions,
        );
        out.counter(
            "softwarp_cq_error_completions_total",
            "Completions queued with a status other than success.",
            &labels,
            self.error_completions,
        );
        out.counter(
            "softwarp_cq_polled_total",
            "Completions taken by the application.",
            &labels,
            self.polled,
        );
        out.counter(
            "softwarp_cq_notifications_total",
            "Completion channel notifications.",
            &labels,
            self.notifications,
        );
        out.counter(
            "softwarp_cq_idle_sleeps_total",
            "Sleeps of a thread that kept polling the CQ while it stayed empty.",
            &labels,
            self.idle_sleeps,
        );
        out.counter(
            "softwarp_cq_refused_total",
            "Completions refused by a full (overflowed) CQ.",
            &labels,
            self.refused,
        );
        out.gauge_int(
            "softwarp_cq_depth",
            "Completions waiting to be polled.",
            &labels,
            self.len as u64,
        );
        out.gauge_int(
            "softwarp_cq_capacity",
            "Capacity in completions.",
            &labels,
            self.capacity as u64,
        );
        out.gauge_int(
            "softwarp_cq_error",
            "1 when the CQ overflowed and is in error.",
            &labels,
            u64::from(self.in_error),
        );
    }

    /// Live details for `softwarp resources`.
    pub(crate) fn details(&self) -> ResourceDetails {
        ResourceDetails {
            state: Some(if self.in_error { "ERROR" } else { "OK" }.to_string()),
            attrs: attrs([
                ("cqe", self.capacity.to_string()),
                ("depth", self.len.to_string()),
                ("completions", self.completions.to_string()),
                (
                    "channel",
                    if self.channel { "yes" } else { "no" }.to_string(),
                ),
            ]),
            ..ResourceDetails::default()
        }
    }
}

impl DescribeResource for CqShared {
    fn describe(&self) -> ResourceDetails {
        let mut details = self.ras_view().details();
        details.markers = self.marker_words();
        details
    }
}
