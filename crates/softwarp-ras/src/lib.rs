//! Softwarp RAS services (temporary header).
#![deny(missing_docs)]

pub mod clock;
pub mod sys;
pub mod trace;

#[doc(hidden)]
pub mod __private {
    pub use tracing;
}
