//! A one-line progress bar on standard error for long benchmark runs: drawn only when
//! standard error is a terminal and the run has lasted more than a second, redrawn at most
//! ten times a second, erased at the end.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

const WIDTH: usize = 30;
const SHOW_AFTER: Duration = Duration::from_secs(1);
const REDRAW: Duration = Duration::from_millis(100);

/// The bar.
#[derive(Debug)]
pub struct Bar {
    enabled: bool,
    total: u64,
    done: u64,
    label: String,
    started: Instant,
    drawn: Option<Instant>,
}

impl Bar {
    /// A bar for `total` units of work (drawn only on a terminal).
    pub fn new(total: u64) -> Self {
        Self {
            enabled: std::io::stderr().is_terminal(),
            total: total.max(1),
            done: 0,
            label: String::new(),
            started: Instant::now(),
            drawn: None,
        }
    }

    /// Names what is running now.
    pub fn label(&mut self, label: String) {
        self.label = label;
        self.draw(false);
    }

    /// Marks `n` more units done.
    pub fn inc(&mut self, n: u64) {
        self.done = (self.done + n).min(self.total);
        self.draw(false);
    }

    fn draw(&mut self, force: bool) {
        if !self.enabled || self.started.elapsed() < SHOW_AFTER {
            return;
        }
        if !force && self.drawn.is_some_and(|t| t.elapsed() < REDRAW) {
            return;
        }
        self.drawn = Some(Instant::now());
        let filled = (self.done * WIDTH as u64 / self.total) as usize;
        let elapsed = self.started.elapsed().as_secs_f64();
        let eta = if self.done > 0 {
            format!(
                "{:.0} s left",
                elapsed * (self.total - self.done) as f64 / self.done as f64
            )
        } else {
            String::from("...")
        };
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r\x1b[K[{}{}] {:>3}% {} ({eta})",
            "#".repeat(filled),
            "-".repeat(WIDTH - filled),
            self.done * 100 / self.total,
            self.label
        );
        let _ = err.flush();
    }

    /// Erases the bar.
    pub fn finish(&mut self) {
        if self.enabled && self.drawn.is_some() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}
