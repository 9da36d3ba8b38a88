//! Property tests: parsers of outside input never panic, and what is printed reads back.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use softwarp_ras::control::{dispatch, DefaultHandler};
use softwarp_ras::stats::{StatsBuilder, TcpInfo};
use softwarp_ras::trace::{Component, Level, TraceSpec};

use crate::common;

fn level() -> impl Strategy<Value = Level> {
    (0u8..=9).prop_map(|n| Level::new(n).unwrap())
}

fn spec() -> impl Strategy<Value = TraceSpec> {
    (
        proptest::option::of(level()),
        proptest::collection::vec((0usize..9, level()), 0..5),
        proptest::option::of(level()),
        proptest::option::of(level()),
        any::<bool>(),
        proptest::collection::vec((any::<u32>(), level()), 0..5),
    )
        .prop_map(
            |(default, comps, other, recorder, clear_qps, qps)| TraceSpec {
                default,
                components: comps
                    .into_iter()
                    .map(|(i, l)| (Component::ALL[i], l))
                    .collect(),
                other,
                recorder,
                clear_qps,
                qps,
            },
        )
}

proptest! {
    #[test]
    fn a_printed_spec_parses_back_to_itself(s in spec()) {
        prop_assert_eq!(s.to_string().parse::<TraceSpec>().unwrap(), s);
    }

    #[test]
    fn spec_parsing_never_panics(text in ".{0,200}") {
        let _ = text.parse::<TraceSpec>();
    }

    #[test]
    fn spec_like_text_never_panics(text in "[a-z:*0-9x=, ]{0,80}") {
        let _ = text.parse::<TraceSpec>();
    }

    #[test]
    fn control_requests_never_panic(line in ".{0,300}") {
        let r = dispatch(&DefaultHandler, &line);
        prop_assert_eq!(r.pid, std::process::id());
    }

    #[test]
    fn json_shaped_control_requests_never_panic(
        op in "(info|resources|stats|trace-get|trace-set|flight-recorder|x)",
        extra in "(|,\"spec\":\"[a-z=0-9,:]{0,20}\"|,\"tail\":[0-9]{1,25}|,\"after\":-?[0-9]{1,25}|,\"tail\":null)",
    ) {
        let line = format!("{{\"op\":\"{op}\"{extra}}}");
        let _ = dispatch(&DefaultHandler, &line);
    }

    #[test]
    fn tcp_info_parsing_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
        let parsed = TcpInfo::parse(&raw);
        prop_assert_eq!(parsed.is_some(), raw.len() >= 104);
    }

    #[test]
    fn any_label_value_and_help_round_trip_through_the_exposition(
        help in ".{0,40}",
        value in ".{0,40}",
        name in "[a-zA-Z0-9_:.-]{0,20}",
        n in any::<u64>(),
    ) {
        let mut b = StatsBuilder::new();
        b.counter(&name, &help, &[("v", &value)], n);
        let text = b.finish().to_prometheus();
        let fams = common::prom::parse(&text).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(fams.len(), 1);
        let fam = fams.values().next().unwrap();
        // Help text is one line in the format: carriage returns survive, as do all others.
        prop_assert_eq!(fam.help.as_deref(), Some(help.as_str()));
        prop_assert_eq!(&fam.samples[0].0["v"], &value);
        prop_assert_eq!(fam.samples[0].1, n as f64);
    }
}
